"""Gradient buckets: DDP's size-capped, dtype-pure groups in reduce order."""

from fdp.bucketing._flat import check_tree as check_tree
from fdp.bucketing._flat import flatten_buckets as flatten_buckets
from fdp.bucketing._flat import pack as pack
from fdp.bucketing._flat import unflatten_buckets as unflatten_buckets
from fdp.bucketing._flat import unpack as unpack
from fdp.bucketing._plan import Bucket as Bucket
from fdp.bucketing._plan import BucketPlan as BucketPlan
from fdp.bucketing._plan import MiB as MiB
from fdp.bucketing._plan import assign_buckets as assign_buckets
from fdp.bucketing._plan import cap_limits as cap_limits
from fdp.bucketing._plan import has_gradient as has_gradient
from fdp.bucketing._plan import plan_buckets as plan_buckets
from fdp.bucketing._plan import plan_for as plan_for

__all__ = [
    "Bucket",
    "BucketPlan",
    "MiB",
    "assign_buckets",
    "cap_limits",
    "check_tree",
    "flatten_buckets",
    "has_gradient",
    "pack",
    "plan_buckets",
    "plan_for",
    "unflatten_buckets",
    "unpack",
]
