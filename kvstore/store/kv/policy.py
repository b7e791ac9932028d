"""What a store's ``storage_policy`` does to each layer it saves.

``"lossless"`` (the default) stores every layer in its own family's encoding.
A lossy policy names the encoding plain layers are stored in instead
(``"kv:quant:8:64"``): a ``kv:plain`` layer is transcoded into it before it is
encoded, a ``kv:rotating-plain`` (sliding-window) layer into its windowed
variant, and layers already encoded (quantized, TurboQuant caches) are kept as
they are, since re-encoding them would only lose more. A restore decodes
whatever was stored into the family of the live cache it fills.

A lossy family joins by one line of :data:`WINDOWED_KIND`; saving then works as
soon as its codec is registered (until then a save raises
``UnknownSignatureError`` naming the registered kinds).
"""

from __future__ import annotations

from kvstore.abc.codec import Snapshot
from kvstore.errors import StoreConfigError
from kvstore.signature import parse_signature

__all__ = ["LOSSLESS", "WINDOWED_KIND", "stored_signature", "apply_policy"]

LOSSLESS = "lossless"

#: A lossy policy's kind -> the kind a sliding-window layer is stored as.
WINDOWED_KIND: dict[str, str] = {
    "kv:quant": "kv:rotating-quant",
    "kv:turboquant": "kv:rotating-turboquant",
}

#: The families a lossy policy re-encodes, and whether each is windowed.
_PLAIN_KINDS = {"kv:plain": False, "kv:rotating-plain": True}


def stored_signature(signature: str, policy: str) -> str:
    """The signature a layer of family ``signature`` is stored as under ``policy``.

    Raises:
        StoreConfigError: ``policy`` is a kind with no entry in :data:`WINDOWED_KIND`.
    """
    sig = parse_signature(signature)
    if policy == LOSSLESS or sig.kind not in _PLAIN_KINDS:
        return str(sig)
    target = parse_signature(policy)
    if target.kind not in WINDOWED_KIND:
        raise StoreConfigError(
            f"[save] storage_policy {policy!r} is not a policy this kvstore applies; "
            f"lossy policies are of kind {', '.join(WINDOWED_KIND)}.",
            found=policy,
            supported=sorted(WINDOWED_KIND),
        )
    if not _PLAIN_KINDS[sig.kind]:
        return str(target)
    return ":".join([WINDOWED_KIND[target.kind], *(str(p) for p in target.params)])


def apply_policy(snapshot: Snapshot, policy: str) -> Snapshot:
    """``snapshot`` in the encoding ``policy`` stores its family as (itself if lossless)."""
    target = stored_signature(snapshot.signature, policy)
    if target == snapshot.signature:
        return snapshot
    from kvstore.codecs import transcode

    return transcode(snapshot, target)
