from fleet.cli.main import app

app()
