"""Refuse, at start, a lockstep host started with options that differ from host 0's.

Hosts that load different models or engine limits compile different
programs, and the first step's collectives would hang rather than fail.
Each host writes a description of itself (its options and a cheap identity
of its model files) to the key-value store once, before the model loads;
host 0 compares each with its own and writes a verdict back; a host whose
description differs stops with the differences named, and so does host 0.
"""

from __future__ import annotations

import hashlib
import json
import os

PREFIX = "jaxinfer/options"


def model_identity(path: str | None) -> dict:
    """A model's files, cheaply: names and sizes (not mtimes, which differ
    between copies), and a digest of a directory's config.json."""
    if path is None:
        return {"model": "embedded default"}
    if os.path.isfile(path):
        return {"model": os.path.basename(path), "size": os.path.getsize(path)}
    if not os.path.isdir(path):
        return {"model": path, "missing": True}
    files = {name: os.path.getsize(os.path.join(path, name)) for name in sorted(os.listdir(path))
             if os.path.isfile(os.path.join(path, name))}
    config = os.path.join(path, "config.json")
    digest = hashlib.sha256(open(config, "rb").read()).hexdigest()[:16] if os.path.isfile(config) else None
    return {"files": files, "config.json": digest}


def differences(ours: dict, theirs: dict) -> list[str]:
    return [f"{key}: host 0 has {ours.get(key)!r}, this host {theirs.get(key)!r}"
            for key in sorted(set(ours) | set(theirs)) if ours.get(key) != theirs.get(key)]


def check_same_options(client, process_id: int, num_processes: int, description: dict,
                       timeout_s: float = 120.0) -> None:
    """Every host calls this once with its description (JSON-able); raises
    ValueError naming the differences on host 0 and on each host that differs."""
    timeout_ms = int(timeout_s * 1000)
    client.key_value_set(f"{PREFIX}/{process_id}", json.dumps(description, sort_keys=True))
    if process_id != 0:
        verdict = json.loads(client.blocking_key_value_get(f"{PREFIX}/verdict/{process_id}", timeout_ms))
        if verdict:
            raise ValueError("this host was started with options that differ from host 0's; refused:\n  "
                             + "\n  ".join(verdict))
        return
    refused = []
    for process in range(1, num_processes):
        theirs = json.loads(client.blocking_key_value_get(f"{PREFIX}/{process}", timeout_ms))
        found = differences(description, theirs)
        client.key_value_set(f"{PREFIX}/verdict/{process}", json.dumps(found))
        if found:
            refused.append(f"process {process}: " + "; ".join(found))
    if refused:
        raise ValueError("hosts started with options that differ from host 0's were refused:\n  "
                         + "\n  ".join(refused))
