"""Credentials the end-to-end systems are started with."""

TINY_API_KEY = "tiny-secret"
