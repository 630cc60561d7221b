"""The query language: parsing and compiling LMQL queries to Python coroutines."""
