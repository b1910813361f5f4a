"""Engines a TE can wrap. One protocol (base.Engine); each engine declares its capabilities."""
