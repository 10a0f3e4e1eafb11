"""``python -m changefeed`` runs the CLI (how the demo and tests start node processes)."""

from changefeed.cli.main import main

main()
