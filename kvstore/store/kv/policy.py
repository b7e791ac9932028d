"""What a store's ``storage_policy`` does to each layer it saves.

``"lossless"`` (the default) stores every layer in its own family's encoding.
A lossy policy names the encoding raw layers are stored in instead
(``"kv:quant:8:64"``, any family declaring ``storage_policy=True``): a layer
of a lossless KV family (``kv:plain``) is transcoded into it before it is
encoded, a sliding-window one (``kv:rotating-plain``) into the windowed family
that keeps a window of the policy's, and layers already encoded (quantized,
TurboQuant caches: lossy families) are kept as they are, since re-encoding
them would only lose more. A restore decodes whatever was stored into the
family of the live cache it fills.

Which families are policies, which are lossy and which windows which are the
families' own declarations (:mod:`kvstore.family`); a family joins by being
registered with its codec.
"""

from __future__ import annotations

from kvstore.abc.codec import Snapshot
from kvstore.errors import StoreConfigError
from kvstore.family import families, windowed_family
from kvstore.signature import parse_signature

__all__ = ["LOSSLESS", "policy_kinds", "stored_signature", "apply_policy"]

LOSSLESS = "lossless"


def policy_kinds() -> list[str]:
    """The kinds a store's ``storage_policy`` may name (registered families that declare it)."""
    return [f.kind for f in families() if f.storage_policy]


def stored_signature(signature: str, policy: str) -> str:
    """The signature a layer of family ``signature`` is stored as under ``policy``.

    Raises:
        StoreConfigError: ``policy`` is not a storage policy, or a sliding-window
            layer meets a policy with no windowed family.
    """
    sig = parse_signature(signature)
    family = sig.family
    if policy == LOSSLESS or family.lossy or not family.holds_kv:
        return str(sig)
    target = parse_signature(policy)
    if not target.family.storage_policy:
        raise StoreConfigError(
            f"[save] storage_policy {policy!r} is not a policy this kvstore applies; "
            f"lossy policies are of kind {', '.join(policy_kinds())}.",
            found=policy,
            supported=policy_kinds(),
        )
    if not family.windowed:
        return str(target)
    windowed = windowed_family(target.kind)
    if windowed is None:
        raise StoreConfigError(
            f"[save] storage_policy {policy!r} has no sliding-window family for the "
            f"sliding-window layer stored as {sig}; store it losslessly or pick a policy "
            f"of kind {', '.join(policy_kinds())} with one.",
            found=policy,
        )
    return windowed.signature(*target.params)


def apply_policy(snapshot: Snapshot, policy: str) -> Snapshot:
    """``snapshot`` in the encoding ``policy`` stores its family as (itself if lossless)."""
    target = stored_signature(snapshot.signature, policy)
    if target == snapshot.signature:
        return snapshot
    from kvstore.codecs import transcode

    return transcode(snapshot, target)
