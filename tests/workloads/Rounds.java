// A JVM workload (tests/soak, tests/e2e/test_real_programs.py): fills MIB MiB of the heap with pseudo-random
// longs once, then every INTERVAL ms prints "round N DIGEST" with DIGEST recomputed from the whole array. The
// array never changes, so every round of this job and of its restored copies must print the same digest.
// Usage: java -cp DIR Rounds MIB INTERVAL_MS
public final class Rounds {
    public static void main(String[] args) throws Exception {
        int mib = Integer.parseInt(args[0]);
        long interval = Long.parseLong(args[1]);
        long[] mem = new long[mib * (1 << 17)];
        long x = 0x9E3779B97F4A7C15L;
        for (int i = 0; i < mem.length; i++) {
            x ^= x << 13; x ^= x >>> 7; x ^= x << 17;
            mem[i] = x;
        }
        System.out.println("start " + digest(mem));
        for (long n = 1; ; n++) {
            System.out.println("round " + n + " " + digest(mem));
            System.out.flush();
            Thread.sleep(interval);
        }
    }

    static String digest(long[] mem) {
        long h = 0xCBF29CE484222325L;
        for (long v : mem) {
            h = (h ^ v) * 0x100000001B3L;
        }
        return Long.toHexString(h);
    }
}
