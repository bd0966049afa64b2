# Write outside the scratch folder: a host file, the checkout, the home folder, system paths.

for path in ["@OUTSIDE@", "@CHECKOUT@/hostile-was-here", "/root/.bashrc", "/root/hostile",
             "/usr/lib/hostile", "/etc/hostile", "/hostile", "/dev/shm/hostile"]:
    try:
        with open(path, "a") as f:
            f.write("hostile\n")
        print("ESCAPED wrote", path)
    except OSError as e:
        print("refused", path, type(e).__name__)
