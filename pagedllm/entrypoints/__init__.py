"""Command line and servers."""
