"""Serving: the app factory, auth, limits, and what every API frontend shares."""
