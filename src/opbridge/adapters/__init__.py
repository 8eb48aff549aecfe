"""Register stage: one adapter per framework, all implementing :class:`~opbridge.adapters.base.Adapter`."""
