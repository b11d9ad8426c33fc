"""Applications built on the ooc library: the ``ooc`` command line, the demo, ``ooc train``, the
predicted-versus-measured check and the timeline plot. The library (every other ``ooc`` module)
never imports this package.
"""
