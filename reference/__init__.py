"""Solutions to the six stages. Solution code sits between BEGIN/END SOLUTION markers; `make student`
turns this package into the student stubs."""
