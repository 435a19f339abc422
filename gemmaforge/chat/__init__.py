"""Gemma's chat formats as objects: one module per format (gemma.py for Gemma 1-3, gemma4.py for Gemma 4), each a
`ChatFormat` (format.py) that renders conversations for training, for a request and as jinja, reads generated
answers back (reading.py), and names its markers. A family (families.py) owns one; every stage asks it.

Adding a family with a new chat format is one new module here plus one row in families.FAMILIES.
"""
