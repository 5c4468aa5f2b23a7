"""Never hang, never outlive the job: the fault monitor, the launch guard and SIGTERM handling."""
