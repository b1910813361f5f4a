"""Scaler: when to scale which model up or down and where."""
