"""What people and programs see: the one layer that renders results.

Every command's output is made here, from the library's result objects, and nowhere else:
rich text for people on stderr, Markdown and HTML reviews, and the ``--json`` document of each
command (one ``*_document()`` function per document; ``cli/output.emit_json`` adds
``schema_version``). The CLI modules parse options, call the library, and hand the result to a
renderer here; the library never formats for people.
"""
