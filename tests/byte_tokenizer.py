"""The package's byte-level tokenizer (moebench.tools.byte_tokenizer), importable from any test folder as it was
before it moved into the package (tests/ is on sys.path through its conftest.py): `from byte_tokenizer import
write_byte_tokenizer`. Not in conftest.py, since every test folder's conftest is imported as `conftest` and the last
one would shadow it."""

from moebench.tools.byte_tokenizer import write_byte_tokenizer

__all__ = ["write_byte_tokenizer"]
