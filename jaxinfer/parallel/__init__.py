"""Multi-device runs: meshes (mesh.py), partition specs of the params and the
KV pool (sharding.py), loading straight into shards (placement.py), the
per-shard Pallas attention (attention.py) and multi-host start-up
(distributed.py). See README.md, "Multi-device"."""
