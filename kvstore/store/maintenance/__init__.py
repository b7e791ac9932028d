"""Maintenance tools over whole stores: :mod:`.inventory` (what a store holds),
:mod:`.transfer` (moving blocks between stores), :mod:`.migrate` (re-encoding a
store) and :mod:`.cache_files` (prompt-cache files in and out of a store).

These sit above the bridge (:mod:`kvstore.bridge`): ``cache_files`` names a model's
namespace and loads model directories.
"""
