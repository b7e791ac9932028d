"""The training tool of the demo model (issue 15): a small llama that writes Python.

* :mod:`.corpus` -- the standard library's sources, ``json``/``email`` held out;
* :mod:`.bpe` -- the byte-level BPE tokenizer and its mlx-lm files;
* :mod:`.model` -- the shape and the decoder (mlx-lm's ``llama`` layout);
* :mod:`.train` -- AdamW, cosine schedule, a wall-clock budget, the best checkpoint;
* :mod:`.export` -- the 4-bit mlx-lm directory;
* :mod:`.verify` -- size, tokenizer round trip, mlx-lm and kvstore loaders agree;
* :mod:`.recipes` -- ``h200`` (the shipped model), ``cpu`` (a placeholder), ``toy``;
* :mod:`.pipeline` -- one run, end to end.

Imports inside the package are relative: the GPU run copies this folder on its
own (``.gpuwork/demo_model/``) and runs it as ``python -m demo_model``.
"""
