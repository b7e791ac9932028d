"""The demo ``kvstore demo`` (and ``make demo``) runs: sessions in fresh processes
sharing a long context through a prefix store.

* :mod:`~kvstore.demo.runner` -- ``run_demo(DemoOptions(...))``: plans and runs the sessions;
* :mod:`~kvstore.demo.session` -- one session, ``python -m kvstore.demo.session``;
* :mod:`~kvstore.demo.script` -- the context, the questions, text to token ids;
* :mod:`~kvstore.demo.shipped` -- the model it runs by default (``kvstore/demo/model/``);
* :mod:`~kvstore.demo.dense` -- quantized weights made dense for the CPU;
* :mod:`~kvstore.demo.blas` -- the fast BLAS for the session processes;
* :mod:`~kvstore.demo.report` -- the table and the answers.

(Nothing is imported here: ``python -m kvstore.demo.session`` must find its
module not yet imported.)
"""
