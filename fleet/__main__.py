from fleet.cli import app

app()
