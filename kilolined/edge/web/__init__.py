"""The dashboard page, served by admin.py (package data)."""
