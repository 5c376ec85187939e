# Given code — read, don't edit. Generated from the kit's reference by `make student`.
"""Solutions to the six stages. Solution code sits between BEGIN/END SOLUTION markers; `make student`
turns this package into the student stubs."""
