"""Structured configs: the dataclasses here are the single source of truth for every knob."""
