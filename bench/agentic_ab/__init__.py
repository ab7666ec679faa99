"""A/B replay of agentic coding traffic against two servers (`python -m bench.agentic_ab`).

corpus (observations from a source tree) and personas (system prompts, tool schemas) feed
workload (the deterministic plan.json); wire (the three streaming APIs) and client (the
closed-loop replay) run a plan against one server; runner starts and stops each arm's server
per seed; stats (block bootstrap), analyze (join with the request logs, metrics) and report
(report.md) turn the rows into the comparison. stdlib + httpx + numpy only.
"""
