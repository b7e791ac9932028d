"""Damage studies: a small store's ``data.mdb`` flipped bit by bit (issue 18)."""
