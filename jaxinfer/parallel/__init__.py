"""Multi-device runs with JAX's own SPMD machinery: meshes (mesh.py), partition
specs of the params and the KV pool (sharding.py), loading straight into
shards (placement.py), the Pallas attention per shard under shard_map
(attention.py) and multi-host
start-up in lockstep (distributed.py); data-parallel replicas are engine-level
(engine/data_parallel.py). See README.md, "Multi-device"."""
