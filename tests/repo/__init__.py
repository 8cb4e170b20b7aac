"""The repository as a whole: the docs and the README's layout, packaging, the deployment files."""
