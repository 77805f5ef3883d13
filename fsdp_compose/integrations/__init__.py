"""The periphery: what lets code written for torch's ``fully_shard`` run on fsdp_compose. It imports the engine;
the engine never imports it (``fully_shard(..., fsdp2_methods=True)`` is the one entry that binds from here).

- ``fsdp2``: FSDP2's method names (``model.unshard()``, ``model.set_requires_gradient_sync(...)``) bound per
  instance on a sharded module;
- ``ports``: ``fc.ported(name)``, a trainer's documented port applied for a ``with`` block;
- ``pipelining``: ``PipelineStage``, torch's pipeline stage answering its FSDP2 branches for fsdp_compose units.
"""
