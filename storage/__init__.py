"""Moving a run's folders between nodes through a storage URI (``cluster.storage``).

Owns one thing: where the policy folder, checkpoints and run state live when the nodes share
no filesystem. Any fsspec URL works (``s3://bucket/prefix``, ``gs://...``, ``file:///mnt/x``);
actors that need a folder copy it to a cache on their own node (``node_copy``). Every package
may import this one; it imports none of them.
"""

from storage.files import atomic_write
from storage.folders import RunStorage, is_storage_url, node_copy, upload_policy

__all__ = ["RunStorage", "atomic_write", "is_storage_url", "node_copy", "upload_policy"]
