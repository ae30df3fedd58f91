"""The prompt bank's words (:mod:`.bank`): topics, contexts, openers, formats, system prompts, code goals,
frames for facts and messages, role-plays, personas, tools. Data only; changing any of it changes the
bank, so bump ``bank.BANK_VERSION`` with it."""

from __future__ import annotations

SCIENCE = (
    "gravity", "photosynthesis", "black holes", "the immune system", "DNA replication", "plate tectonics",
    "the greenhouse effect", "evolution", "antibiotic resistance", "static electricity", "magnets", "rainbows",
    "tides", "the speed of light", "sound waves", "nuclear fusion", "the periodic table", "enzymes", "viruses",
    "the nervous system", "sleep cycles", "the placebo effect", "erosion", "ocean currents", "lightning",
    "supernovas", "dark matter", "the Big Bang", "cell division", "friction", "buoyancy", "entropy",
    "carbon dating", "allergies", "muscle growth", "the gut microbiome", "coral reefs", "bird migration",
    "bioluminescence", "hurricanes", "glaciers", "semiconductors", "batteries", "radio waves", "optical illusions",
)

HISTORY = (
    "the Roman Republic", "the Ottoman Empire", "the Meiji Restoration", "the Black Death", "the Cold War",
    "the Silk Road", "the Aztec Empire", "the Industrial Revolution", "the invention of the telephone",
    "the Reformation", "the Space Race", "the Viking Age", "the Mongol Empire", "the printing press",
    "ancient Greek democracy", "the Hanseatic League", "the Suez Canal", "the Incas", "the Tang dynasty",
    "the abolition of slavery", "the suffragette movement", "the Marshall Plan", "the Apollo programme",
    "the Great Depression", "the Byzantine Empire", "the Code of Hammurabi", "the Magna Carta",
)

TECH = (
    "DNS", "HTTPS", "public-key cryptography", "garbage collection", "virtual machines", "containers",
    "REST APIs", "WebSockets", "database indexes", "hash tables", "recursion", "Big-O notation", "unit tests",
    "version control", "load balancers", "caching", "message queues", "regular expressions", "compilers",
    "operating system schedulers", "TCP vs UDP", "OAuth", "two-factor authentication", "password hashing",
    "floating-point numbers", "Unicode", "CSS flexbox", "React hooks", "SQL transactions", "Kubernetes",
    "large language models", "gradient descent", "overfitting", "transformers in machine learning",
    "GPUs", "SSDs", "Wi-Fi", "Bluetooth", "cloud storage", "microservices", "CI pipelines", "Docker images",
)

EVERYDAY = (
    "budgeting", "meal prep", "decluttering", "houseplants", "composting", "running shoes", "commuting by bike",
    "saving for retirement", "credit scores", "renting a flat", "buying a used car", "cleaning an oven",
    "ironing shirts", "getting rid of fruit flies", "brewing tea", "making cold brew", "baking cookies",
    "grilling vegetables", "packing for a flight", "jet lag", "learning to swim", "posture at a desk",
    "stretching", "drinking enough water", "sleep hygiene", "screen time", "journaling", "habit tracking",
    "keeping a sourdough starter", "painting a room", "fixing a leaky tap", "choosing a mattress",
    "hosting a dinner party", "tipping abroad", "negotiating rent", "freelancing", "side projects",
    "writing a cover letter", "asking for a raise", "working from home", "online dating", "moving to a new city",
)

HOBBIES = (
    "chess", "knitting", "bouldering", "birdwatching", "film photography", "pottery", "calligraphy", "baking bread",
    "home brewing", "playing the ukulele", "learning piano", "skateboarding", "trail running", "fishing",
    "woodworking", "origami", "stargazing", "board games", "crossword puzzles", "gardening", "beekeeping",
    "sketching", "podcasting", "creative writing", "salsa dancing", "yoga", "cycling", "kayaking", "camping",
    "geocaching", "speedcubing", "cosplay", "video editing", "3D printing", "aquariums", "mushroom foraging",
)

PLACES = (
    "Kyoto", "Reykjavik", "Marrakesh", "Buenos Aires", "Vancouver", "Edinburgh", "Hanoi", "Cape Town", "Prague",
    "Seoul", "Mexico City", "Istanbul", "Oslo", "Melbourne", "Porto", "Budapest", "Nairobi", "Lima", "Montreal",
    "Copenhagen", "Bangkok", "Vienna", "Dublin", "Santiago", "Tbilisi", "Krakow", "Seville", "Hokkaido",
)

FOODS = (
    "lentil soup", "banana bread", "fried rice", "shakshuka", "guacamole", "risotto", "pad thai", "hummus",
    "chili", "omelettes", "ramen", "pesto pasta", "granola", "curry", "tacos", "apple crumble", "dumplings",
    "falafel", "pizza dough", "roast chicken", "tomato sauce", "overnight oats", "miso soup", "flatbread",
)

ANIMALS = (
    "octopuses", "crows", "axolotls", "honeybees", "sea otters", "wolves", "elephants", "tardigrades", "owls",
    "dolphins", "ants", "chameleons", "penguins", "bats", "hedgehogs", "jellyfish", "parrots", "capybaras",
)

JOBS = (
    "nurse", "electrician", "data analyst", "primary school teacher", "barista", "software engineer", "architect",
    "paramedic", "accountant", "graphic designer", "chef", "pharmacist", "UX researcher", "plumber", "librarian",
    "project manager", "translator", "veterinarian", "journalist", "warehouse supervisor",
)

ALL_TOPICS = SCIENCE + HISTORY + TECH + EVERYDAY + HOBBIES

CONTEXTS = (
    "I'm a second-year student and we're covering this in class.", "My partner and I were arguing about this.",
    "I work night shifts so my schedule is weird.", "I'm 45 and switching careers.", "I only have about an hour.",
    "English isn't my first language, sorry for mistakes.", "My boss keeps bringing this up in meetings.",
    "I tried looking it up but the explanations were too technical.", "I'm preparing a talk for my team.",
    "I'm on a tight budget this month.", "We just had a baby so I'm pretty tired.", "I'm new to all this.",
    "I've got a deadline on Friday.", "My grandfather asked me and I didn't know.", "I live in a small flat.",
    "I'm writing a newsletter for our neighbourhood.", "I have ADHD so short answers work best for me.",
)

OPENERS = ("hey", "hi", "hello", "ok so", "quick one:", "question", "yo", "hiya", "good morning!", "um", "so")

CLOSERS = ("thanks", "thx", "ty!", "thanks in advance", "cheers", "appreciate it", "pls", "please!",
           "thank you so much", "", "")

FORMATS = (
    "", "", "", "", " Keep it short.", " Use bullet points.", " Answer in one paragraph.", " Under 80 words please.",
    " Give me an example.", " Explain step by step.", " Use a table if it helps.", " No jargon.",
    " Start with a one-sentence answer, then details.", " In three sentences.", " Be detailed.",
    " Use headings.", " Answer like you're talking to a friend.", " Keep it to 5 points max.",
)

SYSTEMS = (
    "You are a helpful assistant.", "You are a helpful assistant.", "You are a concise assistant. Keep answers brief.",
    "You are a patient tutor who explains things step by step.", "You are an assistant for a software company's "
    "developers. Prefer code examples.", "You answer in a warm, encouraging tone.", "You are a careful assistant: "
    "when you are not sure, say so.", "Reply in plain text, no markdown.", "Always answer in British English.",
    "You are a customer service assistant for an online bookshop.", "You are a cooking assistant.",
    "You are a travel planning assistant.", "You help students with homework without just giving the answer.",
    "You are a fitness coach. Be motivating but realistic.", "You are a senior engineer doing code review.",
    "Use markdown formatting with headings and lists.", "Answer in at most three sentences.",
    "You are an assistant inside a note-taking app. Help the user organise their thoughts.",
)

GENERIC_FOLLOW_UPS = (
    "Can you make that shorter?", "ok, and why is that?", "Can you give me a concrete example?", "Thanks! One more "
    "thing: what's the most common mistake here?", "Can you put that in a table?", "Explain the second point more.",
    "hmm, that's confusing", "Can you summarise all of that in one sentence?", "What would an expert add?",
    "great, thanks", "Are there any downsides?", "How would you explain this to a kid?", "can you say it simpler",
    "What should I read next to learn more?", "Is that always true?", "Give me a checklist version.",
    "Now make it more formal.", "What if I only have half the time?", "Could you translate that into Spanish?",
)

LANGS = ("Python", "Python", "Python", "JavaScript", "TypeScript", "Java", "C", "C++", "Go", "Rust", "Bash", "SQL", "Ruby",
         "C#", "Kotlin", "PHP")

CODE_GOALS = (
    "parses a date string like 2024-03-05 into year, month and day", "counts how often each word appears in a file",
    "checks whether two strings are anagrams", "returns the second largest number in a list", "retries a function "
    "call up to three times", "chunks a list into groups of n", "converts a Roman numeral to an integer",
    "finds duplicate files by their hash", "validates that brackets in a string are balanced", "renames every .txt "
    "file in a folder to .md", "computes a moving average", "merges two dictionaries, summing shared keys",
    "generates a random password with letters, digits and symbols", "downloads a web page and counts the links",
    "transposes a matrix", "rotates an array by k places", "implements a stack with push, pop and peek",
    "implements an LRU cache", "reads JSON from a file and prints one field", "groups a list of people by age",
    "checks if a year is a leap year", "converts snake_case to camelCase", "finds the longest common prefix of "
    "strings", "implements FizzBuzz", "debounces a function", "computes the GCD of two numbers", "flattens nested "
    "dictionaries with dotted keys", "counts vowels in a string", "returns the top 3 most frequent elements",
    "removes all whitespace from a string", "shuffles a list in place", "checks if a number is a power of two",
)

CODE_CONSTRAINTS = ("", "", "", " Add comments.", " Include a couple of tests.", " Make it efficient.",
                    " No external libraries.", " Explain the time complexity.", " Keep it short.",
                    " Use type hints.", " Handle edge cases.", " Show example usage.")

_VARS = ("items", "values", "scores", "names", "rows", "data", "nums", "words", "prices", "users")

_OPENINGS = ("Quick update:", "Dear all,", "hi team", "To whom it may concern,", "Hey!", "Notice:", "FYI -", "")

_BODIES = (
    "the {thing} is delayed until {day} because {reason}", "we are changing the {thing} process starting {day}",
    "please remember to submit your {thing} by {day}", "I wanted to say sorry about the {thing} last week",
    "the {thing} went really well and everyone did great work", "there will be no {thing} on {day} due to {reason}",
    "I'm not happy with the {thing} and would like a refund", "can we move the {thing} to {day}, {reason}",
)

_THINGS = ("team meeting", "delivery", "quarterly report", "office party", "software release", "invoice", "workshop",
           "kitchen renovation", "training session", "parcel", "booking", "budget review")

_DAYS = ("Monday", "next Tuesday", "the 14th", "Friday afternoon", "end of the month", "tomorrow", "next week")

_REASONS = ("the supplier is late", "half the team is sick", "the server crashed", "of the bank holiday",
            "we found a bug", "the room is double-booked", "the weather", "I have a doctor's appointment")

_FACT_FRAMES = (
    "{t} has been studied for a long time, and researchers still disagree about some details.",
    "Many people first hear about {t} at school, but the details are rarely explained well.",
    "The most important thing about {t} is how it affects everyday decisions.",
    "Critics argue that the popular story of {t} leaves out the people who did the work.",
    "In the last decade, new tools have changed how experts think about {t}.",
    "A common mistake is to confuse {t} with {u}, although they work very differently.",
    "Costs related to {t} have gone up, which worries families and small businesses.",
    "Some surveys suggest that about {p} percent of people could not explain {t} correctly.",
    "Supporters say {t} will matter even more in the next twenty years.",
    "There are local differences too: what is normal in one country can be rare in another.",
    "Teachers often use simple experiments or stories to make {t} easier to grasp.",
    "The topic became popular online after a series of short videos about {u}.",
)

ROLEPLAYS = (
    ("a grumpy lighthouse keeper", "Is it going to storm tonight?"), ("an enthusiastic museum robot", "What's in this "
     "exhibit?"), ("a 1920s newspaper reporter", "What's the big story today?"), ("a dragon guarding treasure",
     "I come in peace, I just want to talk."), ("a calm meditation teacher", "I'm really stressed today."),
    ("a medieval innkeeper", "Do you have a room for the night?"), ("a spaceship AI", "Status report, please."),
    ("Sherlock Holmes", "My bike was stolen from outside the library."), ("a cheerful gym receptionist", "I'd like to "
     "cancel my membership."), ("a Socratic philosophy teacher", "Is it ever okay to lie?"), ("a shop owner in a "
     "fantasy village", "What potions do you sell?"), ("a sports commentator", "Describe me making a sandwich."),
    ("my strict but fair piano teacher", "I didn't practise this week."), ("an alien tourist visiting Earth",
     "What do you think of pizza?"), ("a job interviewer at a bakery", "Hello, I'm here for the interview."),
    ("a ship's captain in a storm", "Captain, the sails are torn!"), ("a wizard's apprentice", "Can you teach me a spell?"),
)

_FIELDS = (("name", "email", "phone"), ("product", "price", "quantity"), ("city", "date", "temperature"),
           ("title", "author", "year"), ("company", "role", "salary"), ("from", "to", "departure_time"))

TOOLS = (
    {"name": "get_weather", "description": "Current weather for a city",
     "parameters": {"city": "string", "unit": "celsius|fahrenheit"}},
    {"name": "search_web", "description": "Search the web", "parameters": {"query": "string"}},
    {"name": "send_email", "description": "Send an email", "parameters": {"to": "string", "subject": "string",
                                                                          "body": "string"}},
    {"name": "create_event", "description": "Add a calendar event", "parameters": {"title": "string",
                                                                                   "start": "ISO datetime", "minutes": "int"}},
    {"name": "convert_currency", "description": "Convert money", "parameters": {"amount": "number", "from": "string",
                                                                                "to": "string"}},
    {"name": "set_timer", "description": "Start a timer", "parameters": {"minutes": "int", "label": "string"}},
)

# Earlier turns written here (not by the target): the user set up context, the assistant said a line,
# and the user's next message follows on from it.
_SETUPS = (
    ("I'm planning a trip to {p} next month.", "That sounds exciting! How can I help you plan it?",
     ("What should I not miss?", "What's the best area to stay in?", "How many days is enough?", "Is it expensive?")),
    ("I'm working on a {l} project at work.", "Great, what are you working on?",
     ("A small tool that cleans up CSV files. How should I structure it?", "It's a web API. How do I test it?",
      "A script that renames photos by date. Where do I start?")),
    ("I started learning {h} last week.", "Nice! How is it going so far?",
     ("Slowly. Any tips for a complete beginner?", "I'm struggling to practise every day. Any advice?",
      "Good, but what should I learn next?")),
    ("Can you help me with something about {t}?", "Of course. What would you like to know?",
     ("Can you give me an overview?", "What do people usually get wrong about it?", "Why is it important?")),
    ("I need to cook dinner for six people on Saturday.", "Happy to help. Any dietary restrictions?",
     ("no restrictions, but one person doesn't eat meat", "Two are gluten-free.", "None, but I'm on a budget.")),
    ("I'm studying for my exam on {t}.", "Good luck! Which part would you like to go over?",
     ("The basics, I'm lost.", "Can you quiz me?", "Make me a short list of what to revise.")),
)

PERSONAS = (
    "a stressed university student", "a retired electrician", "a small café owner", "a junior web developer",
    "a teenager who writes in lowercase with no punctuation", "a new parent", "a non-native English speaker from "
    "Brazil", "a hobby astronomer", "a nurse on a night shift", "a farmer", "a primary school teacher", "a curious "
    "8-year-old", "a busy lawyer", "an artist selling prints online", "a data scientist", "someone learning to cook",
    "a person planning their wedding", "a marathon runner", "a gamer", "a grandfather new to smartphones",
    "a museum volunteer", "a truck driver", "an exchange student in Japan", "a landlord", "a startup founder",
)

GOALS = (
    "ask a question about {t}", "get help debugging some {l} code (include the code)", "ask for advice on {e}",
    "ask for a recipe with what is in their fridge", "ask for a maths problem to be solved", "ask for a poem for a "
    "special occasion", "ask for help writing a difficult message", "ask for ideas for {h}", "ask for an "
    "explanation of something they read about {t}", "ask for a comparison of two products", "ask how to fix a "
    "problem with their phone", "ask for a workout plan", "ask for a summary of a paragraph (include the paragraph)",
    "ask for a trip plan to {p}", "ask a quick factual question", "ask for feedback on their idea for a business",
    "ask for help with a {l} error message", "ask for help naming something", "vent about their day and ask for advice",
)

KINDS: tuple[tuple[str, float], ...] = (
    ("explain", 10), ("advice", 8), ("howto", 6), ("code_write", 9), ("code_debug", 5), ("code_concept", 5),
    ("maths", 8), ("lists", 7), ("rewrite", 6), ("summarise", 6), ("creative", 6), ("roleplay", 4), ("message", 5),
    ("plan", 4), ("language", 4), ("quick", 4), ("json", 4), ("tools", 3), ("earlier_turns", 4),
    ("self_instruct", 6),
)

# kinds whose text carries code or a given passage: a voice must not mangle it, a format rarely fits
_VERBATIM = ("code_debug", "rewrite", "summarise", "json")
