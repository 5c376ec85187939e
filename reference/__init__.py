"""The six stages' implementation package: one module (or subpackage) per stage, listed in kit/stages.py.

In ``reference/`` it holds the solutions, between BEGIN/END SOLUTION markers; ``make student`` turns it
into ``student/``, the same modules with stubs in their place."""
