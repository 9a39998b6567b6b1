"""Command-line tools: ``coat train`` and friends (entry point: ``coat.cli.main:main``)."""
