"""Agents written in a framework, run durably: each framework's wrapper turns its agent into a
``jetloop.agents.Agent`` whose model adapter goes through the framework's model and whose tools
are the framework's tools with an effect class each.

The engine keeps the loop: every model request is a RunModel step and every tool call the
framework lets us defer is a CallTool step, with the crash semantics of docs/crash-matrix.md.
A tool the framework runs inside its own loop cannot be deferred: it runs inside RunModel and
repeats when RunModel runs again (at-least-once).

One module per framework, each imported lazily (its framework is an optional extra):
``jetloop.agents.frameworks.pydantic_ai``, ``jetloop.agents.frameworks.openai_agents``,
``jetloop.agents.frameworks.claude``.
"""
