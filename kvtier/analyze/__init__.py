"""``kvtier analyze``: from a team's request log, what prefix caching will save and what breaks it.

One concept per module:
- :mod:`~kvtier.analyze.records` / :mod:`~kvtier.analyze.readers`: a log (token ids, text with
  a local tokenizer, or a Mooncake block-hash trace) reduced to kvtier's chunk keys;
- :mod:`~kvtier.analyze.replay` (+ :mod:`~kvtier.analyze.belady`): the reuse bound, hit ratio
  per capacity replaying kvtier's registered eviction policies, Belady's MIN (an offline reference), per TTL;
- :mod:`~kvtier.analyze.breakers` / :mod:`~kvtier.analyze.classify`: silent cache breakers;
- :mod:`~kvtier.analyze.cost`: money saved, from an editable price table (``prices/``);
- :mod:`~kvtier.analyze.report`: the JSON document and the terminal summary;
  :mod:`~kvtier.analyze.plots` / :mod:`~kvtier.analyze.html`: the self-contained HTML page;
- :mod:`~kvtier.analyze.fingerprint`: the CI check on a prompt template's stable prefix;
- :mod:`~kvtier.analyze.command`: the CLI subcommand; :mod:`~kvtier.analyze.synth`: generated
  logs with planted breakers (tests, bench, demos).
Nothing here does I/O except the readers, the report writers and the command. See docs/analyze.md.
"""
