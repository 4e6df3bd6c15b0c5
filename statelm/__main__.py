"""`python -m statelm` runs the command line."""

from statelm.cli.main import app

app()
