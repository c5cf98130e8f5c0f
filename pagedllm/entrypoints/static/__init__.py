"""The engine dashboard's page: plain HTML / JS / CSS, package data (docs/dashboard.md)."""
