"""Call stage: the one op-call core every framework adapter runs on.

- :mod:`opbridge.call.callable` generates each op's public callable from its
  schema (a dict lookup on the dispatching argument's type) and splices the
  adapters' inline fast paths into it.
- :mod:`opbridge.call.dispatch` finds the adapter for an array type (adapters
  are looked up by framework name, so none is imported before it is used).
- :mod:`opbridge.call.core` holds what every adapter does the same way:
  argument, dtype and scalar-range checks, output allocation from the shape rule, the alias
  check of mutating ops, packing results onto the schema's returns, and
  running the declared backward.
- :mod:`opbridge.call.unpassable` names a tensor argument its framework cannot
  hand a kernel (DLPack cannot carry it), with one message in every framework.
- :mod:`opbridge.call.batching` says how a framework's ``vmap`` runs an op
  (one kernel call over the declared rows, or one per batch element).

Adapters (:mod:`opbridge.adapters`) only convert arrays, register with their
framework and pick a stream; they import this stage, never each other.
"""
