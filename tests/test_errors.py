import pytest

from kvstore import errors
from kvstore.errors import (
    CapabilityError,
    CorruptEntryError,
    FormatVersionError,
    KVStoreError,
    ReadOnlyStoreError,
    StoreConfigError,
    StoreError,
    StoreFullError,
    StoreUnavailableError,
    UnknownSignatureError,
)


@pytest.mark.parametrize(
    "cls, builtin",
    [
        (UnknownSignatureError, LookupError),
        (FormatVersionError, ValueError),
        (CorruptEntryError, ValueError),
        (CapabilityError, TypeError),
        (StoreUnavailableError, ConnectionError),
        (StoreConfigError, ValueError),
    ],
)
def test_builtin_mixins(cls, builtin):
    assert issubclass(cls, KVStoreError) and issubclass(cls, builtin)


def test_store_errors_share_a_base():
    for cls in (StoreUnavailableError, StoreFullError, ReadOnlyStoreError, StoreConfigError):
        assert issubclass(cls, StoreError)


def test_every_exported_error_is_drawn_in_the_docstring():
    for name in errors.__all__:
        assert name in errors.__doc__


def test_attributes_and_unquoted_message():
    err = UnknownSignatureError("[x] Unknown kind 'kv:z'.", found="kv:z", supported=["kv:plain"])
    assert str(err) == "[x] Unknown kind 'kv:z'."  # no KeyError-style quoting
    assert err.found == "kv:z" and err.supported == ["kv:plain"]
