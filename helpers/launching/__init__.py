"""Starting and supervising the same training on several processes and machines: mpirun, torchrun and Ray Train."""
