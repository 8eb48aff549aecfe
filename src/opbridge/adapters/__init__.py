"""Register stage: one adapter per framework, each implementing :class:`~opbridge.call.dispatch.Adapter`.

Adapters import the call stage below them, never each other.
"""
