"""One module per `shadowtest` subcommand (group); each exports a click command named `command`.

The CLI discovers the modules in this package, so adding a subcommand touches no other file.
"""
