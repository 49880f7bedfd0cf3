"""Moving a run's folders between nodes through a storage URI (``cluster.storage``).

Owns one thing: where the policy folder, checkpoints and run state live when the nodes share
no filesystem. Any fsspec URL works (``s3://bucket/prefix``, ``gs://...``, ``file:///mnt/x``);
actors that need a folder copy it to a cache on their own node (``node_copy``). And what a
value naming a model or data place means, for admission and runtime alike (``places``:
``classify``, ``model_ref``, ``local_model``, ``local_dir``). Every package may import this one; it imports
none of them.
"""

from storage.files import atomic_write
from storage.folders import RunStorage, is_storage_url, node_copy, upload_policy
from storage.places import PlaceError, classify, local_dir, local_model, model_ref

__all__ = ["PlaceError", "RunStorage", "atomic_write", "classify", "is_storage_url", "local_dir", "local_model",
           "model_ref", "node_copy", "upload_policy"]
