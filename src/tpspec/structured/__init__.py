"""Structured outputs: grammars (xgrammar) that constrain what a request may emit.

``grammar`` turns a request's ``StructuredOutputsParams`` into a compiled matcher (cached, checked
in the driver before the request is admitted); ``request_grammar`` follows one request's output on
a rank, and gives the token bitmask of each position the step samples, drafts or verifies.
``sample.token_bitmask`` applies those masks to the logits, each rank to its own vocab shard.
"""
