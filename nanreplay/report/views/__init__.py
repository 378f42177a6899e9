"""One view model per section of the report: dataclasses built from the analysis JSON, every value computed.

Each module turns part of the analysis into what its section shows; none reads a file
(source lines arrive already read, from `nanreplay.report.sources`) and none renders.
`nanreplay.report.page` puts the sections together.
"""
