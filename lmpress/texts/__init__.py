"""Texts shipped inside the package, read by ``lmpress.data`` as ``builtin:`` sources.

``wikitext2/``: two files of WikiText-2 (Merity, Xiong, Bradbury, Socher, "Pointer Sentinel
Mixture Models", 2016), Wikipedia text under CC BY-SA 3.0 (see ``wikitext2/README.md``).
"""
