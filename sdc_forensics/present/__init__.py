"""What people and programs see: the one layer that renders results.

Every command's output is made here, from the library's result objects, and nowhere else:
rich text for people on stderr, Markdown and HTML reviews, and the ``--json`` document of each
command (one ``*_document()`` function per document; ``cli/output.emit_json`` adds
``schema_version``). The CLI modules parse options, call the library, and hand the result to a
renderer here; the library never formats for people.

One module per document: ``bisect`` (and its evidence table), ``replay``, ``certify``,
``verify``, ``inspect``, ``demo``, ``markdown`` and the HTML report; ``text`` holds what the
text renderers share (tables that suit terminals and logs, values written for people, never a
Python repr). The JSON of each command is documented in docs/json.md, with a schema per
document under docs/schemas/.
"""
