"""Adapters that plug lowlevel into the harnesses and agent frameworks users already run.

Each module is an optional extra and imports its framework at import time; nothing here is
imported by ``import lowlevel`` (a test keeps that true):

- :mod:`lowlevel.integrations.inspect_sandbox`: the ``lowlevel`` sandbox provider for Inspect
  (``pip install '.[inspect]'`` in the lowlevel checkout), registered through Inspect's ``inspect_ai`` entry point.
- :mod:`lowlevel.integrations.autogen_executor`: an AutoGen (autogen-core) ``CodeExecutor``
  (``pip install '.[autogen]'`` in the lowlevel checkout).
- :mod:`lowlevel.integrations.smolagents_executor`: a smolagents ``PythonExecutor`` for
  ``CodeAgent(executor=...)`` (``pip install '.[smolagents]'`` in the lowlevel checkout).
- :mod:`lowlevel.integrations.langchain_tool`: LangChain ``BaseTool`` s ``run_code`` and
  ``run_command`` (``pip install '.[langchain]'`` in the lowlevel checkout).

They use only lowlevel's public API (:class:`lowlevel.Session`, :class:`lowlevel.AsyncSession`,
:func:`lowlevel.run`, :class:`lowlevel.Policy`, :class:`lowlevel.Limits`,
:class:`lowlevel.Result`). The operator's :class:`lowlevel.Policy` is fixed when an adapter is
built; nothing a model sends can widen it. Pages: ``docs/integrations-*.md``.
"""
