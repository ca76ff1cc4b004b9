"""One module per ``kvpeer`` command; :mod:`kvpeer.cli` lists them and dispatches.

Each module has ``HELP`` (one line for ``kvpeer --help``), ``add_arguments(parser)``
and ``run(args) -> int`` (the exit code). Commands read argv (through their parser) and
environment variables; nothing below them does (STYLE rule 7). A ``bench_*`` module is
``kvpeer bench *``. The package imports none of them: the CLI imports only the module of
the command it runs, so ``kvpeer serve`` loads no router, bench or lab code.
"""
