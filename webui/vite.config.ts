import preact from "@preact/preset-vite";
import { defineConfig } from "vitest/config";

// The page is served by statelm at `/`, its files under /webui/ (see statelm/server/webui.py); the build goes
// into the Python package so that the wheel ships it.
export default defineConfig({
  plugins: [preact()],
  base: "/webui/",
  build: {
    outDir: "../statelm/webui/dist",
    emptyOutDir: true,
    target: "es2022",
    modulePreload: { polyfill: false },
  },
  test: { include: ["src/**/*.test.ts"] },
});
