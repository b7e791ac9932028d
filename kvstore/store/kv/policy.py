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

A policy may also be per layer (issue 17): a :class:`~kvstore.layout.LayerLayout`
in its text form, ``"default=kv:quant:8:64;sliding=kv:quant:4:64;0=lossless"``,
each value ``lossless`` or a policy signature, chosen for a layer by its index,
then by its kind (a stored layer's kind is its family's: ``sliding`` for a
windowed family, ``global`` otherwise), then the default; a layer nothing
names is stored losslessly.

Which families are policies, which are lossy and which windows which are the
families' own declarations (:mod:`kvstore.family`); a family joins by being
registered with its codec.
"""

from __future__ import annotations

import functools

from kvstore.abc.codec import Snapshot
from kvstore.errors import StoreConfigError
from kvstore.family import families, windowed_family
from kvstore.layout import LayerLayout, is_layout_text, kind_of_signature, parse_layout
from kvstore.signature import parse_signature

__all__ = [
    "LOSSLESS",
    "policy_kinds",
    "layer_policy",
    "storage_policy_for",
    "stored_signature",
    "apply_policy",
]

LOSSLESS = "lossless"


@functools.lru_cache(maxsize=64)
def _layout(policy: str) -> LayerLayout:
    return parse_layout(policy, operation="save")


def layer_policy(policy: str, index: int, signature: str) -> str:
    """The policy of layer ``index`` (stored as ``signature``'s family) under ``policy``:
    ``policy`` itself, or for a per-layer policy the value it names for the layer
    (``lossless`` where it names none)."""
    if not is_layout_text(policy):
        return policy
    value = _layout(policy).value_for(index, kind_of_signature(signature))
    return LOSSLESS if value is None else value


def policy_kinds() -> list[str]:
    """The kinds a store's ``storage_policy`` may name (registered families that declare it)."""
    return [f.kind for f in families() if f.storage_policy]


def storage_policy_for(layout: LayerLayout | str) -> str:
    """The storage policy that stores layers as a cache layout names them (``kvstore
    tune``'s files): ``lossless`` for a lossless family (``kv:plain``), the family
    itself for a storage policy; canonical text.

    Raises:
        StoreConfigError: a family a store cannot take as its policy.
    """
    from kvstore.store.settings import parse_storage_policy

    def policy_of(value: str) -> str:
        family = parse_signature(value).family
        if not family.lossy and family.holds_kv and not family.windowed:
            return LOSSLESS
        return value

    spec = (
        parse_layout(layout) if is_layout_text(layout) or isinstance(layout, LayerLayout) else None
    )
    if spec is None:
        return parse_storage_policy(policy_of(str(layout)))
    return parse_storage_policy(spec.map_values(policy_of))


def stored_signature(signature: str, policy: str, index: int | None = None) -> str:
    """The signature a layer of family ``signature`` is stored as under ``policy``
    (layer ``index`` of the record, for a per-layer policy).

    Raises:
        StoreConfigError: ``policy`` is not a storage policy, or a sliding-window
            layer meets a policy with no windowed family.
    """
    sig = parse_signature(signature)
    family = sig.family
    if is_layout_text(policy):
        if index is None:
            raise ValueError("[save] A per-layer storage policy needs the layer's index.")
        policy = layer_policy(policy, index, signature)
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


def apply_policy(snapshot: Snapshot, policy: str, index: int | None = None) -> Snapshot:
    """``snapshot`` (of layer ``index``) in the encoding ``policy`` stores its family as
    (itself if lossless)."""
    target = stored_signature(snapshot.signature, policy, index)
    if target == snapshot.signature:
        return snapshot
    from kvstore.codecs import transcode

    return transcode(snapshot, target)
