"""Adapters that plug kvpeer into inference engines (one subpackage per engine)."""
