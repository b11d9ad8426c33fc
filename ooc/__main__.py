from ooc.apps.cli import run

run()
